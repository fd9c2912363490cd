"""The peer plane between daemons: items pushed and pulled, verified on arrival.

An item comes in through ``receiving`` (checked, room reserved, staged, verified, committed)
and goes out through ``sending``, whichever side started the RPC; the client
(``peer_client``) and the ``mtc.v1.Peer`` service (``peer_servicer``) are the RPC plumbing
around them, speaking the wire conventions in ``peerwire``. Below: transport-neutral reading
and verified staging of an item (``transfer``), the bulk TCP data channel beside gRPC
(``datachannel``, reached through ``dataconn``), what can go wrong with a stream
(``streams``) and the daemon's one gRPC port (``grpc_server``). Imports ``local``, ``obs``
and ``core``; never ``storage``.
"""
