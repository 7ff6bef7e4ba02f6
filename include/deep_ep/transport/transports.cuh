#pragma once

// Every transport a kernel may be instantiated with (docs/transport.md): LSA and the emulated NIC
// always, NCCL GIN where the kernel is built against NCCL >= 2.30.4 with DEEP_EP_WITH_GIN; and the
// hybrid mode of the two with remote peers (hybrid.cuh).

#include <deep_ep/transport/emulated.cuh>
#include <deep_ep/transport/hybrid.cuh>
#include <deep_ep/transport/lsa.cuh>
#if DEEP_EP_WITH_GIN
#include <deep_ep/transport/gin.cuh>
#endif
