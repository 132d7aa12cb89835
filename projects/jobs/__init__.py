"""The Celery jobs and the Django glue around the training core.

``tasks`` holds only the task functions (their ``name=`` strings are stable: queued messages must
still route); ``claimed`` is the claim → heartbeat → work → record-failure frame that every claimed
job shares; ``runs`` builds a run's spec and records what the training loop reports;
``evaluations`` drives a queued evaluation. ``training`` is called only through its public
functions and never imports from here.
"""
