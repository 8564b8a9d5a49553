"""`kvserve epp`: kvserve's routing core as the Endpoint Picker of an Envoy-based gateway (the
Gateway API Inference Extension's protocol over Envoy's ext_proc v3)."""
