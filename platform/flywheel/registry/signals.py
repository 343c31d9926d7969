"""What the registry tells the apps above it (which it must not import).

`production_moved(event=AliasEvent)`: production was promoted to a new version; sent inside the move's
transaction by `services.model_promote`, so a receiver's writes commit or roll back with the move."""

from django.dispatch import Signal

production_moved = Signal()
