"""A loopback port for a local job's rendezvous (torch's MASTER_PORT,
FERRY_ROOT): free now, and below the kernel's ephemeral range when that
leaves room, since the job keeps it for its whole run and a port in that
range can be taken meanwhile as the source port of any outgoing connection
on the machine (the root's bind then fails: address in use). The port
after it is free too (ferry's root takes MASTER_PORT + 1). Run as a
script, it prints one."""
import random
import socket


def free_port():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    cands = [random.randrange(10000, lo - 1) for _ in range(64)] if lo > 12000 else []
    for p in cands + [0]:
        # p and p + 1 (a torch job's MASTER_PORT: ferry's root takes the next)
        socks = [socket.socket(), socket.socket()]
        try:
            socks[0].bind(("127.0.0.1", p))
            p = socks[0].getsockname()[1]
            socks[1].bind(("127.0.0.1", p + 1))
            return p
        except (OSError, OverflowError):
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError("no free loopback port")


if __name__ == "__main__":
    print(free_port())
