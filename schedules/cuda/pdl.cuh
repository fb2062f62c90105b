// Programmatic dependent launch (schedules/cuda_pdl.py), sm_90+.
__device__ __forceinline__ void mlcc_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void mlcc_pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }
