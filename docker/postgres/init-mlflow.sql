-- MLflow keeps its runs and registered models in a database of its own, beside Flywheel's.
CREATE DATABASE mlflow OWNER flywheel;
