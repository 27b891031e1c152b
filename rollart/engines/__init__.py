"""Generation and training engines. An engine knows no nodes and no protocol: its node drives it."""
