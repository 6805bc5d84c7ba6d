"""Where the platform's regions are on the map. A node registered with a region and no coordinates
is placed at its region's city, and its agent says so: the recipe an owner follows gives a region,
rarely coordinates, and a node without them is left off the map."""

from __future__ import annotations

# A city per region where its data centres are, (latitude, longitude); the demo fleet's nodes and
# the simulator's regions are these (tests/unit/test_regions.py holds them to it).
REGIONS: dict[str, tuple[float, float]] = {
    "us-east": (39.04, -77.49),  # Ashburn
    "us-west": (37.37, -121.92),  # San Jose
    "eu-west": (51.51, -0.13),  # London
    "eu-central": (50.11, 8.68),  # Frankfurt
    "ap-northeast": (35.68, 139.69),  # Tokyo
    "ap-southeast": (1.35, 103.82),  # Singapore
    "ap-south": (19.08, 72.88),  # Mumbai
    "sa-east": (-23.55, -46.63),  # São Paulo
    "oceania": (-33.87, 151.21),  # Sydney
    "af-south": (-26.20, 28.05),  # Johannesburg
}


def located(
    region: str, latitude: float | None, longitude: float | None
) -> tuple[float | None, float | None, str]:
    """A node's place on the map: the owner's coordinates, else its region's; and a line saying
    which, for the agent to log."""
    if latitude is not None or longitude is not None:
        return latitude, longitude, f"map: the node is at {latitude}, {longitude} (--latitude, --longitude)"
    if (point := REGIONS.get(region)) is not None:
        return (
            *point,
            f"map: the node is at {region}'s location, {point[0]}, {point[1]}"
            " (--latitude and --longitude place it exactly)",
        )
    return (
        None,
        None,
        f"map: the node has no location, so the map lists it but cannot place it: region {region!r} is"
        f" none of {', '.join(REGIONS)}; --latitude and --longitude place it",
    )
