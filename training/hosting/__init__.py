"""Where sessions live: a pool of sessions in one process (pool), the resident trainer service and
its client (service, client, resident), data-parallel ranks (ranks, follower) and a run whose
session the service holds (service_run)."""
