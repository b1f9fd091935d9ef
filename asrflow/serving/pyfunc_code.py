"""The file MLflow runs to build asrflow's pyfunc when a logged model is loaded.

MLflow's "models from code": the model is this script plus the ``asrflow`` package saved
with it, so nothing is unpickled at load time. See :mod:`asrflow.serving.pyfunc`.
"""

import mlflow

from asrflow.serving.pyfunc import AsrflowTranscriber

mlflow.models.set_model(AsrflowTranscriber())
