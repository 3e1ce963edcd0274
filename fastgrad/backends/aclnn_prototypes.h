/*
 * The C prototypes fastgrad's "acl" backend binds, vendored as text from the CANN headers.
 *
 * This file is the single table of the ABI:
 *   - fastgrad/backends/acl_runtime.py parses it and builds every ctypes prototype from it;
 *   - the tests' fake CANN runtime (tests/acl_fake/fake_acl.c) #includes it, so the C compiler
 *     rejects ("conflicting types") any fake definition that disagrees with it.
 * A prototype changed here therefore changes the binding and breaks the fake's build until the
 * fake agrees; neither can drift alone.
 *
 * Parameter types and order are copied from the headers named above each declaration.  The
 * handle and enum typedefs below are ABI-equivalent stand-ins for acl_base.h / acl_meta.h
 * (enums are int-sized, handles are pointers); only this file and the fake use them.
 */
#ifndef FASTGRAD_ACLNN_PROTOTYPES_H_
#define FASTGRAD_ACLNN_PROTOTYPES_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef int aclError;                    /* acl/acl_base.h */
typedef int aclnnStatus;                 /* aclnn/acl_meta.h */
typedef int aclDataType;                 /* acl/acl_base.h enum */
typedef int aclFormat;                   /* acl/acl_base.h enum */
typedef int aclrtMemMallocPolicy;        /* acl/acl_rt.h enum */
typedef int aclrtMemcpyKind;             /* acl/acl_rt.h enum */
typedef void *aclrtStream;               /* acl/acl_base.h */
typedef void *aclrtContext;              /* acl/acl_base.h */
typedef struct aclTensor aclTensor;      /* aclnn/acl_meta.h (opaque) */
typedef struct aclOpExecutor aclOpExecutor;

/* ---- acl/acl.h (runtime repo, include/external/acl/acl.h) -------------------------------- */
aclError aclInit(const char *configPath);
aclError aclFinalize(void);
/* reference-counted de-initialisation (recent CANN): aclInit increments the count even when it
 * returns ACL_ERROR_REPEAT_INITIALIZE; this decrements it and finalizes at 0 */
aclError aclFinalizeReference(uint64_t *refCount);
const char *aclGetRecentErrMsg(void);
/* the CANN package version, e.g. pkgName "runtime" -> "8.2.RC1" (ACL_PKG_VERSION_MAX_SIZE 128) */
aclError aclsysGetVersionStr(char *pkgName, char *versionStr);

/* ---- acl/acl_rt.h --------------------------------------------------------------------------- */
aclError aclrtGetDeviceCount(uint32_t *count);
/* the SoC of the running device as CANN names it ("Ascend910B3", "Ascend910_9391", "Ascend950PR_9599");
 * NULL on failure */
const char *aclrtGetSocName(void);
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtResetDevice(int32_t deviceId);
aclError aclrtGetCurrentContext(aclrtContext *context);
aclError aclrtSetCurrentContext(aclrtContext context);
aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind);

/* ---- aclnn/acl_meta.h (libnnopbase) --------------------------------------------------------- */
aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType,
                           const int64_t *stride, int64_t offset, aclFormat format,
                           const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData);
aclnnStatus aclDestroyTensor(const aclTensor *tensor);
aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor);

/* ---- the aclnn ops (hicann/ops-nn; each second stage is
 *      aclnnStatus aclnnXxx(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
 *                           aclrtStream stream)) ---------------------------------------------- */

/* matmul/fused_linear_online_max_sum/op_api/aclnn_fused_linear_online_max_sum.h:40-44 */
aclnnStatus aclnnFusedLinearOnlineMaxSumGetWorkspaceSize(
    const aclTensor *input, const aclTensor *weight, const aclTensor *target, int64_t vocabStartIndex,
    int64_t vocabEndIndex, aclTensor *logitsMaxLocalOut, aclTensor *sumExpLogitsLocalOut,
    aclTensor *predictedLogitsLocalOut, aclTensor *targetMaskOut, aclTensor *maskedTargetOut,
    aclTensor *vocabParallelLogitsOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnFusedLinearOnlineMaxSum(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                         aclrtStream stream);

/* loss/fused_cross_entropy_loss_with_max_sum/op_api/aclnn_fused_cross_entropy_loss_with_max_sum.h:46-49 */
aclnnStatus aclnnFusedCrossEntropyLossWithMaxSumGetWorkspaceSize(
    const aclTensor *logitsMax, const aclTensor *sumExpLogits, const aclTensor *predictedLogits, float labelSmoothing,
    const aclTensor *inputOptional, const aclTensor *weightOptional, const aclTensor *vocabParallelLogitsOptional,
    aclTensor *lossOut, aclTensor *softMaxOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnFusedCrossEntropyLossWithMaxSum(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                                 aclrtStream stream);

/* matmul/fused_linear_cross_entropy_loss_grad/op_host/op_api/aclnn_fused_linear_cross_entropy_loss_grad.h:45-49 */
aclnnStatus aclnnFusedLinearCrossEntropyLossGradGetWorkspaceSize(
    const aclTensor *grad, const aclTensor *input, const aclTensor *weight, const aclTensor *targetMask,
    const aclTensor *maskedTarget, float labelSmoothing, const aclTensor *logitsMaxOptional,
    const aclTensor *sumExpLogitsOptional, const aclTensor *softmaxOptional, aclTensor *inputGradOut,
    aclTensor *weightGradOut, uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnFusedLinearCrossEntropyLossGrad(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                                 aclrtStream stream);

/* Generated header aclnn_cross_entropy_loss_grad.h (opbuild, from the op definition
 * loss/cross_entropy_loss_grad/op_host/cross_entropy_loss_grad_def.cpp:74-78, whose Float attrs
 * become C double); the same prototype is documented in
 * loss/cross_entropy_loss_grad/docs/aclnnCrossEntropyLossGrad.md:127-141 in every revision of
 * that file.  (Seed 001 prints float: a documentation error, not an ABI.) */
aclnnStatus aclnnCrossEntropyLossGradGetWorkspaceSize(
    const aclTensor *gradLoss, const aclTensor *logProb, const aclTensor *target, const aclTensor *weightOptional,
    const aclTensor *gradZlossOptional, const aclTensor *lseForZlossOptional, char *reductionOptional,
    int64_t ignoreIndex, double labelSmoothing, double lseSquareScaleForZloss, const aclTensor *out,
    uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnCrossEntropyLossGrad(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                      aclrtStream stream);

/* vfusion/scaled_masked_softmax_grad_v2/op_host/op_api/aclnn_scaled_masked_softmax_backward.h:40-44 */
aclnnStatus aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize(
    const aclTensor *gradOutput, const aclTensor *y, const aclTensor *mask, double scale, bool fixTriuMask,
    aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnScaledMaskedSoftmaxBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                             aclrtStream stream);

/* loss/smooth_l1_loss_grad_v2/op_api/aclnn_smooth_l1_loss_backward.h:39-42 */
aclnnStatus aclnnSmoothL1LossBackwardGetWorkspaceSize(
    const aclTensor *gradOut, const aclTensor *self, const aclTensor *target, int64_t reduction, float beta,
    aclTensor *gradInput, uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnSmoothL1LossBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                      aclrtStream stream);

/* index/embedding_dense_grad_v2/op_api/aclnn_embedding_dense_backward.h:58-61 */
aclnnStatus aclnnEmbeddingDenseBackwardGetWorkspaceSize(
    const aclTensor *grad, const aclTensor *indices, uint64_t numWeights, uint64_t paddingIdx, bool scaleGradByFreq,
    const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnEmbeddingDenseBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                        aclrtStream stream);

#endif /* FASTGRAD_ACLNN_PROTOTYPES_H_ */
