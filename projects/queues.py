"""Celery queue names, in one place (STYLE.md: queue named from one enum).

``Queue`` names the platform's own queues. Training work (runs, evaluations, client training
jobs) goes to a *work queue* chosen from its base model (``BaseModel.queue``, set by the operator
with ``manage.py registerbasemodel --queue gpu-large``; empty means ``settings.WORK_QUEUE_DEFAULT``,
"train" unless set), so workers of each GPU class subscribe to theirs:
``celery -A artweb worker -Q gpu-large -c 1 --prefetch-multiplier 1``.
This module stays a plain one (settings import it before Django is set up).
"""

import re
from enum import StrEnum


class Queue(StrEnum):
    TRAIN = "train"
    DEFAULT = "default"


# What a queue name may be: a slug short enough for a column, and what Redis/AMQP keys take as is.
# Matched with fullmatch: with match and "$", a name ending in a newline would pass.
QUEUE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


def queue_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a work queue, or None. The default queue is refused: it carries the
    beat's housekeeping tasks, which an hour-long run in front of them would hold up."""
    if not QUEUE_NAME.fullmatch(name):
        return "use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
    if name == Queue.DEFAULT:
        return f"{Queue.DEFAULT.value!r} is the housekeeping queue; name a work queue such as 'gpu-small' or 'cpu'"
    return None
