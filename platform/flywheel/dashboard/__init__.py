"""The flywheel dashboard: one page over every app's rows, above the apps (see tests/platform/test_import_layers.py)."""
