"""The workplace environment: a simulated company (people, projects, tasks, calendar, email) and its tasks."""

from trainer.envs.workplace.env import WorkplaceEnv
from trainer.envs.workplace.tasks import generate_tasks
from trainer.envs.workplace.tools import DESTRUCTIVE, READ_ONLY, TOOLS

__all__ = ["DESTRUCTIVE", "READ_ONLY", "TOOLS", "WorkplaceEnv", "generate_tasks"]
