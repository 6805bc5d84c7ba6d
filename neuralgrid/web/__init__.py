"""The web UI the gateway serves: the fleet map, API keys for developers, and node operators' page."""
