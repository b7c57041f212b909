"""What the controller and stage processes run on that is not the contract: the transport
(channels, servers, mutual TLS), the security parts, mDNS discovery, process plumbing (logging,
signals, health, systemd) and the model directory."""
