"""Database access: the embedded server, the migration runner and connection helpers."""
