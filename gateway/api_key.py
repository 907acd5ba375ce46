"""The gateway's API key: the variable it is read from, and what it guards.

Apart from the app so that the load generator names the same variable without
importing the gateway's web stack: the locust image holds only what the
locustfile imports (tests/infrastructure/test_compose.py checks that it does).
"""

API_KEY_ENV = "WHISPER_TRITON_API_KEY"
PROTECTED_PREFIX = "/v1/"  # what the key guards: the API, not /health or /docs
