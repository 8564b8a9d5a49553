"""The gateway's live state: its workers (`worker_pool`), how they are found (`discovery`) and
read (`scraper`, `zmq_events` into the exact index), the HTTP client to them, the asyncio face
of admission, the metrics, and `build.build_fleet`, which wires them around the pure core for a
front end."""
