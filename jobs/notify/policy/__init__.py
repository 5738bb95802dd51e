"""The notifications' pure decisions (no ORM, no I/O): which URLs a webhook may reach
(`targets`), which subscriptions hear an event and what they are told (`events`), and when a
failed delivery is tried again (`retry`)."""
