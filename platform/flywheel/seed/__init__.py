"""The demo seeding of `make run` (`manage.py seed_demo`), above every app: it fills each app with demo rows,
so it may import them all and no app imports it (tests/platform/test_import_layers.py). An installed app only
for its management command and its Celery task; it has no models."""
