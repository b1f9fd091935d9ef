"""The trained model as users get it: the bundle, inference, export, the MLflow pyfunc model, the CLI."""
