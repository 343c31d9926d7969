"""Flywheel's web side: Django project and apps."""

from flywheel.celery import app as celery_app

__all__ = ("celery_app",)
