"""The OpenAI-compatible gateway: keys, limits, routing through the SQL matcher, proxying, metering."""
