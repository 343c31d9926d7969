"""Training jobs: the platform's side of the trainer's job contract (a job directory, `python -m trainer
train` as a subprocess, its JSON-lines events turned into progress rows), the advice before a job, cancel,
retry from the last checkpoint, and the reaper for jobs whose worker vanished."""
