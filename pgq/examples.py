"""Example handlers, ready for ``pgq worker pgq.examples:log_job --queue Q``.

The docker compose file runs one; they are also a starting point to copy.
"""

from __future__ import annotations

import logging

from .job import Job

log = logging.getLogger("pgq.examples")


def log_job(job: Job) -> None:
    """Log the job and succeed."""
    log.info("job %s from %s: %r", job.id, job.queue, job.body[:200])


def fail_on_error(job: Job) -> None:
    """Fail (and so retry, then dead-letter) jobs whose body contains b"error"."""
    if b"error" in job.body:
        raise ValueError(f"job {job.id} asked to fail")
    log_job(job)
