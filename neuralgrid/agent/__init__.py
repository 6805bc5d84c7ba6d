"""The node agent a GPU owner runs: detect the GPU, register, heartbeat, front the backend."""
