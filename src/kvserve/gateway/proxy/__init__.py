"""kvserve's own front end: an ASGI proxy (`endpoint`) that admits, routes and relays each
request, sending it with `forward.Forwarder`; `app.create_gateway` builds it on a fleet."""
