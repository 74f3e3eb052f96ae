"""`pdchat serve`: pdchat's engine behind the OpenAI HTTP API, with Prometheus metrics."""
