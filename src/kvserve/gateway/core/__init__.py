"""The gateway's pure routing core: tenancy, keys, the routing pipeline, admission and one
request's dispatch lifecycle. No HTTP, asyncio or clock of its own; the live fleet
(`gateway.fleet`) and the front ends (`gateway.proxy`, `gateway.epp`, the simulator) drive it."""
