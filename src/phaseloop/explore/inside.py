"""Explore: inside pages and endpoints (issue 26). Placeholder until its pages land."""

PAGES: list[dict] = []  # nav entries: {"group": ..., "title": ..., "url": ...}


def routes(ctx) -> list:
    return []
