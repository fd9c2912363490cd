"""The peer plane between daemons: items pushed and pulled, verified on arrival.

The client (``peer_client``), the ``mtc.v1.Peer`` service (``peer_servicer``), the wire
conventions both speak (``peerwire``), transport-neutral reading and verified staging of an
item (``transfer``), the bulk TCP data channel beside gRPC (``datachannel``) and the daemon's
one gRPC port (``grpc_server``). Imports ``local``, ``obs`` and ``core``; never ``storage``.
"""
