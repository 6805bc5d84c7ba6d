"""What an operator does as the service: load fleets, issue and revoke keys."""
