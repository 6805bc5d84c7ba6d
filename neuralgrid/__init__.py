"""NeuralGrid: route OpenAI-compatible inference to other people's GPUs; the matcher lives in Postgres."""

__version__ = "0.1.0"
