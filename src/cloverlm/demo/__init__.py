"""`clover demo`: no-fly zones from air-traffic messages, Clover beside its peer, with the 3D zone map."""
