"""What a client and the Triton models agree on: the tensor names every config.pbtxt
uses, the request parameters and how they parse, and the numeric tensors that
carry a decoded recording from `whisper` to `postprocessing`. The server's
adapters, the clients and the gateway all import it; it imports no torch."""
