"""Signals the accounts app sends for the apps above it: accounts is the lowest layer and imports none of
them (tests/platform/test_import_layers.py), so an app that must act on a new project listens here."""

from django.dispatch import Signal

# Sent by `services.project_create` inside its transaction, with `project`: a receiver's rows commit (or
# roll back) with the project's. The failures app gives the project its taxonomy.
project_created = Signal()
