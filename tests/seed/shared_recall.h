/* The seed article's protocol header (section 4.1, include/shared_recall.h), with the
 * punctuation the published text lost restored ('<', '>', quotes). Byte layout unchanged.
 * Used by tests/seed_client.c and by the layout check in tests/test_seed_compat.py.
 */
#ifndef SHARED_RECALL_H
#define SHARED_RECALL_H

#include <stdint.h>

#define SHM_NAME "/kalos_recall_shm"
#define MAX_QUERY_DIM 1024
#define MAX_RESULT_ITEMS 16
#define MAX_MEMORY_ITEMS 65536

typedef struct {
    uint32_t magic;        // 魔数，校验共享内存是否初始化
    uint32_t version;      // 协议版本
    uint32_t request_id;   // 请求编号，防止重复处理
    uint32_t query_dim;    // query 向量维度
    uint32_t memory_count; // 当前记忆条目数
    uint32_t ready;        // 1 表示请求已就绪
    uint32_t done;         // 1 表示结果已就绪
    uint32_t result_count; // 实际返回的 top-k 条数
    float query[MAX_QUERY_DIM];
    int32_t result_ids[MAX_RESULT_ITEMS];
    float result_scores[MAX_RESULT_ITEMS];
} recall_shm_t;

#endif // SHARED_RECALL_H
