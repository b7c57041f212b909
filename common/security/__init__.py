"""The mesh's security parts: a bundle (one party's certificate, key and the CA's certificate), the
CA that issues bundles, one-time join tokens, and the revocation list."""
