"""The model registry: base models, model versions (a base plus an adapter) with their lineage, the aliases
`production` and `candidate` with their history, promotion and rollback, and the MLflow bridge."""
