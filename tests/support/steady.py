"""A publisher and subscriber pair that must lose nothing, for tests that
put the broker under hostile load or churn."""
import socket
import threading

from .waiting import wait_until


class SteadyPair:
    """Messages alternate between a public key and the subscriber's own
    !/cred/ key; the subscriber checks that every one arrives, once, in
    order. The publisher keeps at most ``window`` messages in flight."""

    def __init__(self, broker, window=200):
        self.pub = broker.connect(timeout=60)
        self.sub = broker.connect(timeout=30)
        self.sub.send(b"SUB steady/seq")
        self.sub.send(b"SUB !/cred////steady/")
        self.cred_prefix = self.sub.sync().encode() + b"/"     # b"!/cred/G/U/P/"
        self.keys = (b"steady/seq", self.cred_prefix + b"steady/seq")
        self.sub.settimeout(0.5)
        self.window = window
        self.sent = self.received = 0
        self.errors = []
        self.stop_flag = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def packet(self, i):
        return b"MSG " + self.keys[i % 2] + b"\0%08d" % i + b"s" * (i % 257)

    def _read(self):
        try:
            while not self.stop_flag:
                try:
                    packet = self.sub.recv(1 << 20)
                except socket.timeout:
                    continue
                if packet == b"":
                    self.errors.append("subscriber disconnected")
                    return
                want = self.packet(self.received)
                if packet != want:
                    self.errors.append(f"message {self.received}: got {packet[:60]!r}, "
                                       f"want {want[:60]!r}")
                    return
                self.received += 1
        except Exception as e:  # pragma: no cover - reported through errors
            self.errors.append(repr(e))

    def publish(self, budget):
        """Send up to budget messages, respecting the window; returns how many."""
        n = 0
        while n < budget and self.sent - self.received < self.window:
            self.pub.send(self.packet(self.sent))
            self.sent += 1
            n += 1
        return n

    def finish(self, timeout=60.0):
        """Wait for everything sent to arrive, stop the reader; True if all did."""
        wait_until(lambda: self.received >= self.sent or self.errors, timeout, fail=False)
        self.stop_flag = True
        self.reader.join(5)
        return self.received == self.sent and not self.errors

    def close(self):
        self.pub.close()
        self.sub.close()
