"""Where sessions live: the one rule that places work (placement); the SessionHost every kind of
work opens its sessions through (resident: this process's keeper over a pool of sessions, pool, or
the trainer service's, service and its client); data-parallel ranks (ranks, follower, followers);
and a run's handle on its session, in the worker (in_process) or on the service (service_run). A
worker process builds its one host in projects.jobs.hosts."""
