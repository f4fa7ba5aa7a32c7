"""The stages a request goes through: E (encode, with the store lookup and the pending
marks), P and D or PD (generate), replay and resume when an instance dies, Mooncake's
E-after-PD, and pass-through routes."""
