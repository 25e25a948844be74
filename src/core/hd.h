/* Code shared by the CPU and CUDA kernels is written once, with FR_HD. */
#ifndef FR_HD_H
#define FR_HD_H
#ifdef __CUDACC__
#define FR_HD static __host__ __device__ __forceinline__
#else
#define FR_HD static inline
#endif
#endif
