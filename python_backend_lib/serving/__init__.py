"""What the Triton model adapters in `model_repository/` share: config settings, request
parameters, input checks, error responses by whose fault, admission (the request
limit), the `whisper_*` metrics, and the tensor names every config.pbtxt uses."""
