"""The distributed cache: block ownership, the peer protocol and its seal, and the node's peer router."""
