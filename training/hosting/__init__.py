"""Where sessions live: the one rule that places work (placement), a pool of sessions in one
process (pool), the resident trainer service and its client (service, client, resident),
data-parallel ranks (ranks, follower, followers) and a run's handle on its session, in the worker
(in_process) or on the service (service_run)."""
