"""The Envoy bootstrap that puts `kvserve epp` in front of the workers, printed by
`kvserve epp --print-envoy-config`: a listener whose HTTP connection manager runs the ext_proc
filter (the picker) and then routes to the workers' cluster, whose override_host load-balancing
policy connects where the picker's `x-gateway-destination-endpoint` says and retries down its
fallback list. (An ORIGINAL_DST cluster reads one address from that header, so its retries
would go back to the worker that just failed.)

Fail-closed (`failure_mode_allow: false`): when the picker cannot be reached Envoy answers 500
itself. Failing open would pass requests on without a tenant's salt, without the API-key check
and without a destination (the cluster would have nowhere to send them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TEMPLATE = """\
# Envoy in front of `kvserve epp` (the Endpoint Picker): `envoy -c THIS_FILE`.
# Clients -> {listen_host}:{listen_port} -> ext_proc (picker at {epp_host}:{epp_port}) -> the
# worker the picker names in x-gateway-destination-endpoint (ip:port[,fallback,...]).
admin:
  address: {{socket_address: {{address: {listen_host}, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: kvserve_inference
    address: {{socket_address: {{address: {listen_host}, port_value: {listen_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: kvserve_inference
          # Streams run as long as the workers generate: no overall limit, only an idle one.
          request_timeout: 0s
          stream_idle_timeout: {idle_timeout_s}s
          route_config:
            name: kvserve_workers
            virtual_hosts:
            - name: workers
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: kvserve_workers
                  timeout: 0s
                  idle_timeout: {idle_timeout_s}s
                  # Before the first byte only: a worker that refuses the connection, resets
                  # it or pushes back (429, 503) is skipped for the next endpoint of the list.
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset,retriable-status-codes
                    retriable_status_codes: [429, 503]
                    num_retries: {num_retries}
                    per_try_timeout: 0s
                # The worker that answered, read back by the picker on the response path.
                response_headers_to_add:
                - header: {{key: x-gateway-destination-endpoint-served, value: "%UPSTREAM_REMOTE_ADDRESS%"}}
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: kvserve_epp}}
              # Fail closed: without the picker a request would go on unsalted, unauthenticated
              # and with no destination; Envoy answers 500 instead.
              failure_mode_allow: false
              # The picker holds a request while admission queues it: up to {queue_wait_s}s.
              message_timeout: {message_timeout_s}s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: {body_mode}
                request_trailer_mode: SEND
                response_header_mode: SEND
                # Each chunk, so the picker sees the first byte and the end of a stream.
                response_body_mode: STREAMED
                response_trailer_mode: SKIP
              metadata_options:
                forwarding_namespaces:
                  untyped: [envoy.lb, envoy.lb.subset_hint]
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  # The workers; Envoy's override_host policy sends each request to the first endpoint the
  # picker named and each retry to the next one of its list.
  - name: kvserve_workers
    type: {cluster_type}
    connect_timeout: 1s{dns_options}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
    circuit_breakers:
      thresholds:
      - {{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000,
         max_retries: 100000}}
    load_assignment:
      cluster_name: kvserve_workers
      endpoints:
      - lb_endpoints:
{worker_endpoints}
  - name: kvserve_epp
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: kvserve_epp
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: {epp_host}, port_value: {epp_port}}}}}
"""  # noqa: E501

BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")


@dataclass(frozen=True, slots=True)
class EnvoyConfig:
    """What the bootstrap needs to know. `queue_wait_s`: the longest a request may wait for
    admission in the picker (the ext_proc message timeout is above it)."""

    listen_port: int
    epp_port: int
    admin_port: int
    listen_host: str = "0.0.0.0"
    epp_host: str = "127.0.0.1"
    workers: tuple[str, ...] = ()  # ip:port, as the picker names them
    dns_names: tuple[str, ...] = ()  # NAME:PORT (--worker-dns): Envoy resolves them too
    dns_refresh_s: float = 5.0
    body_mode: str = "FULL_DUPLEX_STREAMED"
    queue_wait_s: float = 30.0
    num_retries: int = 2
    idle_timeout_s: int = 600

    def render(self) -> str:
        """The bootstrap YAML; raises ValueError for a port or mode it cannot use."""
        for name, port in (("--listen-port", self.listen_port), ("--grpc-port", self.epp_port),
                           ("--envoy-admin-port", self.admin_port)):
            if not 0 < port < 65536:
                raise ValueError(f"{name} must be a TCP port (1-65535), got {port}")
        if not self.workers and not self.dns_names:
            raise ValueError("give the workers (--worker http://IP:PORT or --worker-dns "
                             "NAME:PORT, repeatable): Envoy's cluster lists the endpoints the "
                             "picker may name")
        if self.body_mode not in BODY_MODES:
            raise ValueError(f"--envoy-body-mode must be one of {', '.join(BODY_MODES)}")
        return TEMPLATE.format(
            listen_host=self.listen_host, listen_port=self.listen_port,
            admin_port=self.admin_port, epp_host=self.epp_host, epp_port=self.epp_port,
            body_mode=self.body_mode, num_retries=max(0, self.num_retries),
            queue_wait_s=f"{self.queue_wait_s:g}",
            message_timeout_s=math.ceil(self.queue_wait_s) + 5,
            idle_timeout_s=self.idle_timeout_s,
            worker_endpoints="\n".join(_lb_endpoint(e) for e in self.workers + self.dns_names),
            # A headless Service's pods are the cluster's hosts, re-resolved as the picker's
            # --worker-dns is; a plain list needs no DNS.
            cluster_type="STRICT_DNS" if self.dns_names else "STATIC",
            dns_options=(f"\n    dns_lookup_family: V4_PREFERRED\n    dns_refresh_rate: "
                         f"{self.dns_refresh_s:g}s" if self.dns_names else ""))


def _lb_endpoint(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    return (f"        - endpoint: {{address: {{socket_address: {{address: \"{host.strip('[]')}\", "
            f"port_value: {port}}}}}}}")
