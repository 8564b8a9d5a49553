"""The gateway's commands: `kvserve gateway` (the proxy), `kvserve epp` (the Endpoint Picker)
and `kvserve up` (workers and a gateway in one), all on the shared flags of `gateway.py`."""
