"""What the Triton model adapters in `model_repository/` share: config settings, input
checks, error responses by whose fault, admission (the request limit) and the
`whisper_*` metrics. The tensor names and request parameters they share with the
clients are the `contract` layer's."""
