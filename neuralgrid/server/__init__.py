"""The platform process: settings, assembly of gateway, Realtime and web, serving, the sweeper."""
