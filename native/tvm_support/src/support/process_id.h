// Included by disco's NCCL sources; nothing from it is used there.
#ifndef MLCC_SRC_SUPPORT_PROCESS_ID_H_
#define MLCC_SRC_SUPPORT_PROCESS_ID_H_
#endif  // MLCC_SRC_SUPPORT_PROCESS_ID_H_
