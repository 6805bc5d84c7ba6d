"""Development tools: a fake inference server and the demo fleet."""
