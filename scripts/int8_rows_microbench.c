// Micro-benchmark for issue 14's next step: B = 8 activation rows x 512 weight rows, K = 576 (SmolLM2's dim),
// one thread, L1/L2-resident. The f32 tile of the exact numerics' batched kernels (4 rows x 2 vectors of 8 lanes)
// against int8 products kept per row: ggml's vec_dot order (eight per-quad f32 accumulators, what the llamacpp
// numerics would need), and one f32 step per block of 32 after an exact integer sum (a new numerics).
// Build and run: gcc -O3 -mavx2 -mfma scripts/int8_rows_microbench.c -o /tmp/i8 && /tmp/i8
// Measured 2026-12-03 (docs/server.md, "Not done yet"): f32 38-43, ggml order 45-49, per block 60-82,
// per block from nibbles 53-72 G multiply-adds/s.
// B=8 activation rows x (8 weight rows per group), K = 576 (18 blocks of 32): f32 tile vs int8 per-row forms
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define NB 18
#define K (NB*32)
#define G 64   // weight-row groups of 8 (512 rows)
uint8_t W[G][NB][8][32];      // per group, block, quad j: 8 rows x 4 u8 (pre-unpacked 0..15)
uint8_t Wn[G][NB][4][32];     // nibble-packed: quads j and j+4 in the low/high nibbles
float dW[G][NB][8];
int8_t X[8][K]; float dX[8][NB];
float Xf[8][K]; uint8_t Q[G][K][4]; // f32 path: lanes = rows; 8 rows' nibbles... (use 8 bytes per k for 16 rows? keep 8 rows x u8)
float out[8][G*8];
// int8, ggml-compatible: 8 per-quad f32 accumulators per (activation row, 8 weight rows)
__attribute__((noinline)) void i8_ggml(void){
  const __m256i ones=_mm256_set1_epi16(1);
  for(int g=0;g<G;g++) for(int t=0;t<8;t++){
    __m256 acc[8]; for(int j=0;j<8;j++) acc[j]=_mm256_setzero_ps();
    for(int b=0;b<NB;b++){ __m256 d=_mm256_mul_ps(_mm256_loadu_ps(dW[g][b]), _mm256_set1_ps(dX[t][b]));
      const int32_t* xq=(const int32_t*)&X[t][b*32];
      for(int j=0;j<8;j++){ __m256i w=_mm256_loadu_si256((__m256i*)W[g][b][j]);
        __m256i p=_mm256_maddubs_epi16(w,_mm256_set1_epi32(xq[j])); __m256i s=_mm256_madd_epi16(p,ones);
        acc[j]=_mm256_fmadd_ps(d,_mm256_cvtepi32_ps(s),acc[j]); } }
    __m256 s=acc[0]; for(int j=1;j<8;j++) s=_mm256_add_ps(s,acc[j]); _mm256_storeu_ps(&out[t][g*8],s); } }
// int8, one f32 step per block (integer sum over the whole block first), weights pre-unpacked
__attribute__((noinline)) void i8_block(void){
  const __m256i ones=_mm256_set1_epi16(1);
  for(int g=0;g<G;g++) for(int t=0;t<8;t++){ __m256 acc=_mm256_setzero_ps();
    for(int b=0;b<NB;b++){ const int32_t* xq=(const int32_t*)&X[t][b*32]; __m256i s16=_mm256_setzero_si256();
      for(int j=0;j<8;j++){ __m256i w=_mm256_loadu_si256((__m256i*)W[g][b][j]);
        s16=_mm256_add_epi16(s16,_mm256_maddubs_epi16(w,_mm256_set1_epi32(xq[j]))); }
      __m256 d=_mm256_mul_ps(_mm256_loadu_ps(dW[g][b]), _mm256_set1_ps(dX[t][b]));
      acc=_mm256_fmadd_ps(d,_mm256_cvtepi32_ps(_mm256_madd_epi16(s16,ones)),acc); }
    _mm256_storeu_ps(&out[t][g*8],acc); } }
// same with nibble-packed weights (unpacked in registers, per activation row)
__attribute__((noinline)) void i8_block_nib(void){
  const __m256i ones=_mm256_set1_epi16(1), m=_mm256_set1_epi8(15);
  for(int g=0;g<G;g++) for(int t=0;t<8;t++){ __m256 acc=_mm256_setzero_ps();
    for(int b=0;b<NB;b++){ const int32_t* xq=(const int32_t*)&X[t][b*32]; __m256i s16=_mm256_setzero_si256();
      for(int j=0;j<4;j++){ __m256i raw=_mm256_loadu_si256((__m256i*)Wn[g][b][j]);
        __m256i lo=_mm256_and_si256(raw,m), hi=_mm256_and_si256(_mm256_srli_epi16(raw,4),m);
        s16=_mm256_add_epi16(s16,_mm256_maddubs_epi16(lo,_mm256_set1_epi32(xq[j])));
        s16=_mm256_add_epi16(s16,_mm256_maddubs_epi16(hi,_mm256_set1_epi32(xq[j+4]))); }
      __m256 d=_mm256_mul_ps(_mm256_loadu_ps(dW[g][b]), _mm256_set1_ps(dX[t][b]));
      acc=_mm256_fmadd_ps(d,_mm256_cvtepi32_ps(_mm256_madd_epi16(s16,ones)),acc); }
    _mm256_storeu_ps(&out[t][g*8],acc); } }
// f32 reference form: lanes = 8 weight rows, tile of 4 activation rows, 2 tiles
__attribute__((noinline)) void f32_tile(void){
  for(int g=0;g<G;g+=2) for(int t0=0;t0<8;t0+=4){ __m256 a[8]; for(int i=0;i<8;i++) a[i]=_mm256_setzero_ps();
    for(int k=0;k<K;k++){ __m256i z=_mm256_cvtepu8_epi32(_mm_loadl_epi64((__m128i*)Q[g][k]));
      __m256 v0=_mm256_cvtepi32_ps(z), v1=_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((__m128i*)Q[g+1][k])));
      for(int r=0;r<4;r++){ __m256 x=_mm256_broadcast_ss(&Xf[t0+r][k]); a[2*r]=_mm256_fmadd_ps(x,v0,a[2*r]); a[2*r+1]=_mm256_fmadd_ps(x,v1,a[2*r+1]); } }
    for(int r=0;r<4;r++){ _mm256_storeu_ps(&out[t0+r][g*8],a[2*r]); _mm256_storeu_ps(&out[t0+r][g*8+8],a[2*r+1]); } } }
int main(){ for(int g=0;g<G;g++)for(int b=0;b<NB;b++){for(int j=0;j<8;j++)for(int i=0;i<32;i++)W[g][b][j][i]=(g*7+b*3+j*5+i)&15; for(int r=0;r<8;r++)dW[g][b][r]=0.01f;}
  for(int t=0;t<8;t++)for(int k=0;k<K;k++){X[t][k]=(int8_t)((t*13+k*7)%255-127);Xf[t][k]=X[t][k]*0.01f;} for(int t=0;t<8;t++)for(int b=0;b<NB;b++)dX[t][b]=0.02f;
  double macs=8.0*G*8*K; void (*fs[])(void)={f32_tile,i8_ggml,i8_block,i8_block_nib}; const char* names[]={"f32 tile 4x2","int8 ggml 8-lane","int8 per block","int8 per block nib"};
  for(int rep=0;rep<2;rep++) for(int f=0;f<4;f++){ fs[f](); double best=1e9; for(int r=0;r<20;r++){double t0=now(); for(int i=0;i<20;i++) fs[f](); double dt=(now()-t0)/20; if(dt<best)best=dt;}
    printf("%-20s %.3f ms  %.1f G MAC/s\n", names[f], best*1e3, macs/best/1e9); }
}
