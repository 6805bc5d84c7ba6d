"""What node agents and gateways say to each other: shapes and signatures both sides import."""
